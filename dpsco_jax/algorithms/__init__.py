"""Private optimization algorithms, one module per algorithm family."""
