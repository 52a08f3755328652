"""Start-up: bootstrap of a communicator's parts, the MPI library and the launch-size check, node-shared memory, what a rank records of itself for the launcher."""
