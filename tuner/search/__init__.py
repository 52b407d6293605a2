"""The search: the space, the memory model's feasibility, the requirement, storage and the trial loop (serial or one worker per GPU), and its progress."""
