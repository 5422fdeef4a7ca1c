"""A run whose host count changes, for the elastic-resume tests: each part resumes from the state the last saved."""

from __future__ import annotations

import json


def host_steps(make, schedule, before_last=None):
  """Each global step of a run whose host count changes ([(hosts, steps)], each part resuming from the state
  host 0 saved): the list of the hosts' batches. `before_last()` runs before the last part starts."""
  steps, state = [], None
  for part, (hosts, count) in enumerate(schedule):
    if part == len(schedule) - 1 and before_last is not None:
      before_last()
    its = []
    for h in range(hosts):
      it = iter(make(h, hosts))
      if state is not None:
        it.set_state(state)
      its.append(it)
    for _ in range(count):
      steps.append([next(it) for it in its])
    state = json.loads(json.dumps(its[0].get_state()))
  return steps
