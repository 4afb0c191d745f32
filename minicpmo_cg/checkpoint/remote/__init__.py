"""Code files a checkpoint folder carries (``auto_map``); the builder copies them in verbatim."""
