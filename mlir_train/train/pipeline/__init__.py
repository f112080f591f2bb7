"""Pipeline parallelism inside the one compiled train step."""
