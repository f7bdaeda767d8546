"""The pipeline's data types: the lowest floor of consumer_kit (they import nothing above them)."""
