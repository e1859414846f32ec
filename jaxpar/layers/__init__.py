"""Building blocks of the models: math plus the few tensor-parallel reductions Megatron needs."""
