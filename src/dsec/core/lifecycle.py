"""The sandbox lifecycle as one transition table.

Theory of operation:

* Everything that changes a sandbox's state goes through :func:`apply`; nothing else
  assigns a state. Illegal transitions are missing keys and raise :class:`InvalidState`.
* The table knows nothing about backends: the edge performs the side effects (start a
  container, tear it down) and reports what happened as an :class:`Event`.
* ``STOPPED`` and ``FAILED`` are terminal: their resources are released and the record is
  kept only for listing and audit.

::

    CREATING --started--> RUNNING --pause--> PAUSED --resume--> RUNNING
       |  \\                 |  \\              |  \\
       |   failed            |   died          |   died ------> FAILED
       |     \\               |     \\--------------------------> FAILED
       +--stop--> STOPPING <--stop--+---------stop
                     |--stopped--> STOPPED
                     +--failed---> FAILED
"""

from __future__ import annotations

import enum

from dsec.core.errors import InvalidState


class State(enum.Enum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class Event(enum.Enum):
    STARTED = "started"
    FAILED = "failed"
    PAUSE = "pause"
    RESUME = "resume"
    STOP = "stop"
    STOPPED = "stopped"
    DIED = "died"


TRANSITIONS: dict[State, dict[Event, State]] = {
    State.CREATING: {
        Event.STARTED: State.RUNNING,
        Event.FAILED: State.FAILED,
        Event.STOP: State.STOPPING,
    },
    State.RUNNING: {
        Event.PAUSE: State.PAUSED,
        Event.STOP: State.STOPPING,
        Event.DIED: State.FAILED,
    },
    State.PAUSED: {
        Event.RESUME: State.RUNNING,
        Event.STOP: State.STOPPING,
        Event.DIED: State.FAILED,
    },
    State.STOPPING: {
        Event.STOPPED: State.STOPPED,
        Event.FAILED: State.FAILED,
    },
    State.STOPPED: {},
    State.FAILED: {},
}

TERMINAL = frozenset(s for s, moves in TRANSITIONS.items() if not moves)
LIVE = frozenset({State.CREATING, State.RUNNING, State.PAUSED, State.STOPPING})


def apply(state: State, event: Event) -> State:
    """Return the state after ``event``; raise InvalidState if the move is not allowed."""
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        raise InvalidState(f"sandbox is {state.value}: cannot {event.value}") from None


def can(state: State, event: Event) -> bool:
    return event in TRANSITIONS[state]
