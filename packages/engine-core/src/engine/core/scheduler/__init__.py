"""The default scheduler, its request record and the built-in scheduling policies."""

from engine.core.scheduler.policies import FCFSPolicy, PriorityPolicy
from engine.core.scheduler.request import Request
from engine.core.scheduler.scheduler import Scheduler
from engine.core.scheduler.waiting_queue import WaitingQueue

__all__ = ["Scheduler", "Request", "WaitingQueue", "FCFSPolicy", "PriorityPolicy"]
