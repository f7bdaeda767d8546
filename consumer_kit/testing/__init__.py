"""Testing kit for users' handlers (pytest plugin ``consumer_kit.testing.plugin``)."""
