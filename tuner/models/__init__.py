"""Model sources: a Hugging Face checkpoint or cache folder, the weightless presets, and the embedded tiny model."""
