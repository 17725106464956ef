"""A reward a randomly initialised tiny model can learn in a few dozen GRPO steps: the share of
digits in the response (the arith reward needs a model that can already do sums). Written for verl:
`compute_score(data_source, solution_str, ground_truth, extra_info=None)`."""


def digit_share(data_source, solution_str, ground_truth, extra_info=None):
    return sum(char.isdigit() for char in solution_str) / max(1, len(solution_str))
