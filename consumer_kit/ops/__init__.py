"""What operators use: the commands behind the CLI and the console, pressure statistics, gauges, the AsyncAPI document."""
