"""A job that is one and fails as one: who belongs to it (job identity), where it listens (listeners), collective
timeouts, the stop agreement, finite-state checks."""
