"""Inference engines behind the `RolloutEngine` seam, and the router that spreads trajectories over them."""
