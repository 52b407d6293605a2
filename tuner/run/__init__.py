"""Where a trial's server runs: the engine-neutral process lifecycle, the devices it sees, one measured config."""
