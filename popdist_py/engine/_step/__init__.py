"""A step as its replicas see it: the replica a piece of code runs as (``context``), above the
collectives it enters and the state it reads."""
