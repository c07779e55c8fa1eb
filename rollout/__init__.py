"""Rollout: the async multi-turn agent loop, its engines, tools, interactions and the trajectory record."""
