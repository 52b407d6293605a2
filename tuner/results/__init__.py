"""What a study leaves: the trials frame, the front, plots, report.html, the exported command, comparisons."""
