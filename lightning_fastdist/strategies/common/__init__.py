"""What two or more engines use: ``SharedHooks`` (what every strategy does on its hooks), how options are checked,
launch and joining, the Lightning patterns an engine refuses, the communication metrics, the registry of names."""
