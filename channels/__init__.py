"""Edge adapters: turn wire input into Harness calls and Harness events into wire output."""
