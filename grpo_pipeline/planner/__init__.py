"""The memory planner: will a verl layout fit, which layouts do, and the rules a layout must keep."""
