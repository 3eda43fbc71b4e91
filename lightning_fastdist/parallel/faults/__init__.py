"""A job that fails as one: job identity, collective timeouts, the stop agreement, finite-state checks."""
