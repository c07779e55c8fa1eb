"""The training recipe: config, data, rewards, RL algorithms, the trainer and its entry point."""
