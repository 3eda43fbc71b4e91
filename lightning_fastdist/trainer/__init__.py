"""What we change on one Lightning ``Trainer`` instance, below the strategies and callbacks: the registry of
Lightning's private names we use (:mod:`.internals`), and the preemption path that replaces its signal handling."""
