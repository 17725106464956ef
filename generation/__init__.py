"""Generation: one package below the stages and the backends that both the local backend's rollouts
and the evaluation stage call."""
