"""What several adapters share (pull loop, lock heartbeat, give-backs, copy trimming, URL options, counters); only adapters import it."""
