"""The fp64 reference and the pools: outside oracles, properties, buffered == recurrent, bad inputs."""
