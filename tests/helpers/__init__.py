"""What the tests share: checkpoints, running servers and other real processes, batch builders, references."""
