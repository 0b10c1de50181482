"""Pure metric functions: the tasks score with them, the evaluate stage reports them."""
