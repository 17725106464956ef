"""The cluster preflight: before a job is submitted (or the cluster evaluates), every node's image is
asked what it has (cluster/node_image.py) and judged against what the run needs (profiles/requirements.py).

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device gpu --ray-address head:6379
    # "preflight: 4 nodes answered in 2.1 s, 1 image; every node can run the train stage"

A node that cannot run it stops the run before anything is submitted: one line per node (nodes with
the same problems share a line), each saying what is missing or mismatched, what
was found and the fix. The answers are kept (`nodes.json` in the run folder) and shown as a table of
what each image has, one column per distinct image, so 64 identical nodes are one column.
"""

from __future__ import annotations

import json
import re
import time

from pydantic import BaseModel, Field

from grpo_pipeline.cluster.node_image import STACK, look
from grpo_pipeline.cluster.node_tasks import on_every_node
from grpo_pipeline.cluster.ray_cluster import node_label
from grpo_pipeline.errors import UserError
from grpo_pipeline.profiles.requirements import NodeFacts, NodeProblem, NodeRequirement, node_problems

NODES_NAMED = 3  # a group of nodes names this many, then counts the rest
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class NodesCannotRun(UserError):
    """Some node's image lacks what the run needs: nothing was submitted."""


class Preflight(BaseModel):
    """What every node answered, and how long asking took."""

    stage: str = Field(..., description="The stage the nodes were checked for (`train`, `evaluate`).")
    seconds: float = Field(..., description="From the first task sent to the last answer.")
    requirements: dict[str, NodeRequirement] = Field(default_factory=dict)
    nodes: list[NodeFacts] = Field(default_factory=list)
    silent: list[str] = Field(default_factory=list, description="A line per node that did not answer.")

    def problems(self, facts: NodeFacts) -> list[NodeProblem]:
        return node_problems(facts, self.requirements)

    def groups(self) -> list[tuple[list[str], NodeFacts]]:
        """Nodes with the same image (the same answers for the shown names, torch's build, imports,
        registries and devices) grouped, so 64 identical nodes are one column."""
        groups: dict[str, tuple[list[str], NodeFacts]] = {}
        names = self.shown_names()
        for facts in self.nodes:
            key = json.dumps([[facts.versions.get(n) for n in names], facts.unreadable, facts.torch_build, facts.devices,
                              facts.devices_offered, facts.imports, facts.registries], sort_keys=True, default=str)
            groups.setdefault(key, ([], facts))[0].append(facts.node)
        return list(groups.values())

    def shown_names(self) -> list[str]:
        """The requirements, then the rest of the stack any node has."""
        names = [name for name in ("python", *self.requirements) if name != "devices"]
        names += [n for n in STACK if n not in names and any(f.versions.get(n) for f in self.nodes)]
        return names

    def refusal(self) -> str | None:
        """The error when some node cannot run the stage: a line per distinct set of problems (the nodes
        that share it named together), and one per silent node."""
        nodes_with: dict[str, list[str]] = {}
        for facts in self.nodes:
            if problems := self.problems(facts):
                nodes_with.setdefault(" | ".join(map(str, problems)), []).append(facts.node)
        lines = [f"{_nodes(names)}: {problems}" for problems, names in nodes_with.items()] + self.silent
        if not lines:
            return None
        bad = sum(map(len, nodes_with.values())) + len(self.silent)
        total = len(self.nodes) + len(self.silent)
        head = (f"{bad} of {total} Ray node{'s' if total != 1 else ''} cannot run the {self.stage} stage; nothing was "
                f"{'submitted' if self.stage == 'train' else 'started'}:")
        return "\n".join([head, *(f"  {line}" for line in lines)])

    def summary_line(self) -> str:
        images = len(self.groups())
        verdict = f"every node can run the {self.stage} stage" if self.refusal() is None else "see the refusal"
        return (f"preflight: {len(self.nodes)} node{'s' if len(self.nodes) != 1 else ''} answered in "
                f"{self.seconds:.1f} s, {images} image{'s' if images != 1 else ''}; {verdict}")

    def table(self) -> list[str]:
        """Markdown: a column per distinct image, a row per package (and the devices, and the verdict)."""
        groups = self.groups()
        if not groups:
            return [f"No node answered: {'; '.join(self.silent)}"]
        rows = [["", *(_nodes(names) for names, _ in groups)]]
        for name in self.shown_names():
            rows.append([name, *(self._cell(name, facts) for _, facts in groups)])
        rows.append(["devices", *(f"{f.devices} (Ray offers {f.devices_offered:g})" for _, f in groups)])
        rows.append([f"can run {self.stage}", *("yes" if not (p := self.problems(f)) else "no: " + "<br>".join(x.found for x in p)
                                                for _, f in groups)])
        lines = ["| " + " | ".join(_cell_text(c) for c in row) + " |" for row in rows]
        lines.insert(1, "|" + "---|" * len(rows[0]))
        return lines + ([""] + [f"- {line}" for line in self.silent] if self.silent else [])

    def _cell(self, name: str, facts: NodeFacts) -> str:
        found = facts.versions.get(name)
        if found is None:
            return "-"
        text = found if name not in facts.installed_as else f"{found} ({facts.installed_as[name]})"
        if name == "torch" and facts.torch_build:
            text += f" ({facts.torch_build})"
        need = self.requirements.get(name)
        if need is not None and need.registry and need.knows:
            held = facts.registries.get(need.registry)
            text += f", knows {need.knows}" if isinstance(held, list) and need.knows in held else f", not {need.knows}"
        return text


def _nodes(names: list[str]) -> str:
    if len(names) == 1:
        return f"node {names[0]}"
    shown = ", ".join(names[:NODES_NAMED])
    return f"{len(names)} nodes ({shown}{f' and {len(names) - NODES_NAMED} more' if len(names) > NODES_NAMED else ''})"


def _cell_text(text: str) -> str:
    return text.replace("|", "\\|")


def run_preflight(requirements: dict[str, NodeRequirement], resource: str | None, stage: str,
                  timeout_s: float) -> Preflight:
    """Ask every alive node (Ray initialised with the run's runtime env: the caller's connection)."""
    from ray.exceptions import GetTimeoutError

    started = time.monotonic()
    specs = {name: need.model_dump() for name, need in requirements.items()}
    facts, silent = [], []
    for node, answer, exc in on_every_node(look, specs, timeout_s, timeout_s=timeout_s):
        if exc is None:
            offered = node["Resources"].get(resource, 0) if resource else 0
            facts.append(NodeFacts(node=node_label(node), devices_offered=offered, **answer))
        elif isinstance(exc, GetTimeoutError):
            silent.append(f"node {node_label(node)}: did not answer the preflight in {timeout_s:.0f} s (its Ray "
                          "workers did not start, or hung: see the node's Ray logs; cluster.preflight_timeout_s sets "
                          "the wait)")
        else:  # the task itself failed on that node: it cannot run the job either
            cause = getattr(exc, "cause", None) or exc  # RayTaskError(X): X, without Ray's colours
            said = next((line for line in _ANSI.sub("", str(cause)).splitlines() if line.strip()), "")
            silent.append(f"node {node_label(node)}: the check did not run ({type(cause).__name__}: {said[:200]}); "
                          "see the node's Ray logs")
    facts.sort(key=lambda f: f.node)
    return Preflight(stage=stage, seconds=round(time.monotonic() - started, 3), requirements=requirements,
                     nodes=facts, silent=silent)
