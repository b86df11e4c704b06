"""What a job will be, decided in poprun's process before anything starts: the hosts, the plan
(instances x replicas over the hosts, each instance's environment), the one mpiexec command."""
