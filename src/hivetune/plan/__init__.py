"""Memory and time planner: will a training config fit on a GPU, and how long will it take."""
