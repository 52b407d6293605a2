"""The load a config meets: the streaming client, prompts, the load plan and its lengths, pure metric functions."""
