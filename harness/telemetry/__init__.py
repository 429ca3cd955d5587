"""What the harness tells operators: metrics, and the ids log lines carry.

What the harness tells operators: counters and histograms for /metrics, and the ids a log line
carries."""
