"""Datasets: the validated prompt batches the trainer reads (RL) and the SFT conversations; the tasks' own rows
are built in recipe/tasks/."""
