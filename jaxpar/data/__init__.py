"""Input pipelines. Synthetic tokens for now; grain-based text and robot episodes come with issue 7."""
