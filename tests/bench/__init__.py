"""`kvbuffer bench`: the parts a CPU can check, and the commands end to end."""
