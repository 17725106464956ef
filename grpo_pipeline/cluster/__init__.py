"""Ray and its nodes: the address, the connection and its end, what each node's image has, the preflight."""
