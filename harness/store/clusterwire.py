"""The turn's command path on a Redis Cluster.

The turn's command path on a Redis Cluster: each command to the primary that owns its key's
slot, over a `Pool` of that node, with the cluster's redirections followed here.

Why not redis-py's `RedisCluster.execute_command`: besides its cost per command (measured in
deploy/bench/bench_cluster_wire.py), it sends a command again after a connection error, when
the command may already have run, and keel's COMMIT must never run twice; and on CLUSTERDOWN it
closes every connection of the client, those of other tasks' calls in flight too. Here a call
is sent again only when it is known not to have run: a MOVED, ASK, TRYAGAIN or CLUSTERDOWN
reply (Redis refused it) or a connection that could not be made (`NotSent`). The slot map is
redis-py's (`nodes_manager`): a MOVED patches it; a node that cannot be reached or a CLUSTERDOWN
makes it read again. Retries stop after `REDIRECT_S`, and the last error is the answer.

Every command keel sends this way names its key first (`XADD key ...`, `SPUBLISH channel ...`;
EVALSHA's first key), and commands of one call that share a slot go in one write.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterDownError, MovedError, NoScriptError, TryAgainError

from harness.store.client import Client
from harness.store.wire import QUIET, TIMEOUT_S, NotSent, Pool, Replicas, Wire, raised

log = logging.getLogger("keel.store")
REDIRECT_S = 10.0  # how long a call follows redirections and waits out a failover
POST_WAIT_S = 0.001  # how long lazy writes are gathered before they are posted (`_post`)
LAZY_CLOSE_S = 1.0  # how long closing waits for the lazy writes still on their way
LAZY_WAIT_S = 1.0  # how long a call waits for its slots' lazy writes gone the long way (then goes on)
BACKOFF_S = (0.02, 0.05, 0.1, 0.2, 0.4, 0.5)  # waits between tries that found no owner
REFUSALS = (MovedError, AskError, TryAgainError, ClusterDownError)  # (followed: see `_refused`)
# a rider's reply when the script it rode with was refused: it ran first, so it is sent again
BEFORE_SCRIPT = TryAgainError("sent again after its script")


def wire_for(client: Client, replicas: Replicas | None = None, origin: str = "") -> AnyWire:
    """The hot path for the process's client: to one server, or over a cluster. `origin`: the
    process's, given to every script (whose notices then skip a process that only hears itself)."""
    if isinstance(client, RedisCluster):
        return ClusterWire(client, replicas=replicas, origin=origin)
    return Wire(client, replicas=replicas, origin=origin)


_SLOTS: dict[Any, int] = {}  # a key's slot, for the keys used lately (a session's, again and again)
SLOTS_MEMO = 50_000


def slot_of(command: Sequence[Any]) -> int:
    """The slot `command` is routed to (by its `key_of`)."""
    key = _routing_key(command)
    slot = _SLOTS.get(key)
    if slot is None:
        slot = key_slot(key if isinstance(key, bytes) else str(key).encode())
        if len(_SLOTS) >= SLOTS_MEMO:
            _SLOTS.clear()
        _SLOTS[key] = slot
    return slot


def key_of(command: Sequence[Any]) -> bytes:
    """The key a command is routed by: EVALSHA's first key, XREADGROUP's first stream, else its
    first argument."""
    key = _routing_key(command)
    return key if isinstance(key, bytes) else str(key).encode()


def _routing_key(command: Sequence[Any]) -> Any:
    name = command[0]
    if name in ("EVALSHA", "EVAL"):
        return command[3]
    if name == "XREADGROUP":
        return command[list(command).index("STREAMS") + 1]
    return command[1]


class ClusterWire:
    def __init__(
        self,
        cluster: RedisCluster,
        *,
        timeout: float | None = None,
        replicas: Replicas | None = None,
        origin: str = "",
    ) -> None:
        self.cluster = cluster
        self.replicas = replicas
        # every script's ARGV[2:]: who writes, and the store's windows (`Store`; see `lua._EMIT`)
        self.argv: tuple[str, ...] = (origin,) if origin else ()
        self.timeout = timeout or TIMEOUT_S
        self._pools: dict[str, Pool] = {}
        self._ready = False
        self._gathered: list[Sequence[Any]] = []  # lazy writes to post, gathered (`_post`) ...
        self._gathered_slots: set[int] = set()  # ... and their slots
        self._gathering: asyncio.TimerHandle | None = None
        self._posted: set[asyncio.Future[list[Any]]] = set()  # lazy writes posted, their replies to come
        self._lazy_slots: dict[int, set[asyncio.Task[None]]] = {}  # lazy writes gone the long way (`_lazy`), by slot

    async def close(self) -> None:
        """Close every node's pool once the lazy writes on their way are done (at most
        `LAZY_CLOSE_S`: what a process that stops did not send, the next activity does)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LAZY_CLOSE_S
        self._post_gathered()
        if self._posted:
            await asyncio.wait(set(self._posted), timeout=LAZY_CLOSE_S)
        lazies = set().union(*self._lazy_slots.values())  # (a refused posted write goes the long way)
        if lazies:
            await asyncio.wait(lazies, timeout=max(deadline - loop.time(), 0))
        for task in lazies:
            task.cancel()
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            await pool.close()

    async def call(
        self, commands: Sequence[Sequence[Any]], *, durable: bool = False, ordered: bool = True
    ) -> list[Any]:
        """Each command on its slot's owner (one write per slot, the slots at once); every reply
        in order, an error reply as the exception in its place (as `Pool.call`). `durable`:
        each slot's commands wait for the replicas (`Replicas`), if the wire has any. Lazy
        writes gathered in a slot of `commands` go first, and (`ordered`) those of its slots on
        their way the long way are waited for (`_on_slot`): a read or a removal after a write
        comes after it."""
        if len(commands) == 1:
            slot = slot_of(commands[0])
            if slot in self._gathered_slots:
                self._post_gathered()
            return await self._group(slot, list(commands), durable, ordered)
        by_slot: dict[int, list[int]] = {}
        for n, command in enumerate(commands):
            by_slot.setdefault(slot_of(command), []).append(n)
        if self._gathered_slots and not self._gathered_slots.isdisjoint(by_slot):
            self._post_gathered()
        replies: list[Any] = [None] * len(commands)
        groups = list(by_slot.items())
        sends = [self._group(slot, [commands[n] for n in idx], durable, ordered) for slot, idx in groups]
        done = [await sends[0]] if len(sends) == 1 else await asyncio.gather(*sends)
        for (_, idx), got in zip(groups, done, strict=True):
            for n, reply in zip(idx, got, strict=True):
                replies[n] = reply
        return replies

    async def _group(self, slot: int, commands: list[Sequence[Any]], durable: bool, ordered: bool) -> list[Any]:
        if not (durable and self.replicas):
            return await self._on_slot(slot, commands, ordered=ordered)
        got = await self._on_slot(slot, [*commands, self.replicas.wait()], unit=True, ordered=ordered)
        self.replicas.check(got[-1])
        return got[:-1]

    async def script(self, sha: str, source: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        return (await self.script_with(sha, source, keys, args, ()))[0]

    async def read(self, sha: str, source: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """A script that writes nothing, on its session's node: not waited for by replicas."""
        evalsha = ("EVALSHA", sha, len(keys), *keys, *args, *self.argv)
        slot = slot_of(evalsha)
        for attempt in range(2):
            (reply,) = await self._on_slot(slot, [evalsha])
            if isinstance(reply, NoScriptError) and attempt == 0:
                await self._load(slot, source)
                continue
            return raised([reply])[0]
        raise AssertionError("unreachable")

    async def script_with(
        self,
        sha: str,
        source: str,
        keys: Sequence[Any],
        args: Sequence[Any],
        also: Sequence[Sequence[Any]],
        *,
        lazy: Sequence[Sequence[Any]] = (),
        post: bool = False,
    ) -> list[Any]:
        """The script on its session's node, then (only once it has run) the commands `also`,
        which live in other slots: a job added after the write it stands for, as on one server.
        Error replies are raised. Then `lazy`, whose loss is repaired later (an owner's list of
        sessions): not waited for by replicas, its failures let be (a node of the list down, or
        its replica, is no reason to refuse a message that is safe). It is waited for (a new
        session's first place in the list: a read from anywhere right after finds it), or, with
        `post`, not (a listed session's move on activity): gathered with the lazy writes of the
        next millisecond and posted with them, as few commands, on its node's shared link
        (`_post`); a call of this process after this one that reads its key finds it written.
        Without replicas, those of `also` and (unless posted) of `lazy` whose slot the script's
        node owns ride in the script's write, after it (as on one server: run after the script,
        whatever it answers); one refused there (its slot moved meanwhile) goes again the usual
        way."""
        if self.replicas is None:
            batch: list[Sequence[Any]] = [("EVALSHA", sha, len(keys), *keys, *args, *self.argv)]
        else:  # (the notice once WAIT had its replicas, not from the script)
            evalsha = ("EVALSHA", sha, len(keys), *keys, *args, *QUIET, *self.argv[1:])
            batch = [evalsha, *self.replicas.sync(keys)]
        slot = slot_of(batch[0])
        extra = [*also] if post else [*also, *lazy]  # (posted, the lazy writes are gathered: `_post`)
        riding = self._riders(slot, extra) if self.replicas is None and extra and self._ready else []
        batch += [extra[n] for n in riding]
        for attempt in range(2):
            got = await self._on_slot(slot, batch, unit=self.replicas is not None, riders=len(riding))
            reply = got[0]
            if isinstance(reply, NoScriptError) and attempt == 0:
                await self._load(slot, source)
                continue
            raised(got[: len(got) - len(riding)])
            if self.replicas is not None:
                await self._mark(slot, self.replicas, keys, got[1:])
            break
        tail = got[len(got) - len(riding) :]
        if len(riding) == len(extra) and not any(isinstance(r, Exception) for r in tail):
            # (as nearly always: whatever was to go with the script rode with it, and ran)
            if post:
                self._post(lazy)
            return [reply, *tail[: len(also)]]
        if not riding:
            return await self._after(reply, also, lazy, post)
        rode = dict(zip(riding, tail, strict=True))
        done = {n: r for n, r in rode.items() if not isinstance(r, Exception)}  # (else: sent again below)
        left_also = [c for n, c in enumerate(also) if n not in done]
        left_lazy = list(lazy) if post else [c for n, c in enumerate(lazy, start=len(also)) if n not in done]
        _, *sent = await self._after(reply, left_also, left_lazy, post)
        replies = iter(sent)
        return [reply, *(done[n] if n in done else next(replies) for n in range(len(also)))]

    async def _after(
        self, reply: Any, also: Sequence[Sequence[Any]], lazy: Sequence[Sequence[Any]], post: bool
    ) -> list[Any]:
        """A script's reply, and the replies of `also`, sent once it ran (then `lazy`: `post`ed
        or waited for)."""
        rest = raised(await self.call(also, durable=True)) if also else []
        if post:
            self._post(lazy)
        elif lazy:
            await self._lazy(lazy)
        return [reply, *rest]

    def _post(self, lazy: Sequence[Sequence[Any]]) -> None:
        """`lazy` gathered with the other lazy writes of the next `POST_WAIT_S` (or until a
        call of this wire is for one of their slots: they go ahead of it), then posted together
        (`together`)."""
        if not lazy:
            return
        self._gathered.extend(lazy)
        self._gathered_slots.update(slot_of(c) for c in lazy)
        if self._gathering is None:
            self._gathering = asyncio.get_running_loop().call_later(POST_WAIT_S, self._post_gathered)

    def _post_gathered(self) -> None:
        """The gathered lazy writes, as few commands, sent on each node's shared link, their
        replies not waited for (`Pool.post`); a node whose link is not open yet, or a slot map
        that lacks one, gets them the long way."""
        if self._gathering is not None:
            self._gathering.cancel()
            self._gathering = None
        if not self._gathered:
            return
        lazy, self._gathered = together(self._gathered), []
        self._gathered_slots.clear()
        try:
            nodes: dict[str, tuple[ClusterNode, list[Sequence[Any]]]] = {}
            for command in lazy:
                node = self._owner(slot_of(command))
                nodes.setdefault(node.name, (node, []))[1].append(command)
        except Exception:  # (a slot no node owns just now)
            self._lazy_later(lazy)
            return
        for node, commands in nodes.values():
            posted = self._pool(node).post(commands, functools.partial(self._answered, commands))
            if posted is None:
                self._lazy_later(commands)
            elif not posted.done():
                self._posted.add(posted)

    def _answered(self, commands: Sequence[Sequence[Any]], replies: asyncio.Future[list[Any]]) -> None:
        """The replies of posted lazy writes: a refused one (its slot moved) goes again the long
        way, which follows the cluster's redirections; a failure is let be."""
        self._posted.discard(replies)
        if replies.cancelled():
            return
        failed = replies.exception()
        if failed is not None:
            log.warning("a lazy write after a script failed: %s", failed)
            return
        got = replies.result()
        refused = [c for c, r in zip(commands, got, strict=True) if isinstance(r, REFUSALS)]
        errors = [r for r in got if isinstance(r, Exception) and not isinstance(r, REFUSALS)]
        if errors:
            log.warning("a lazy write after a script failed: %s", errors[0])
        if refused:
            self._lazy_later(refused)

    def _lazy_later(self, lazy: Sequence[Sequence[Any]]) -> None:
        """`lazy` the long way, a task a slot; until one is done, a call for its slot waits for
        it (`call`'s `ordered`; at most `LAZY_WAIT_S`)."""
        by_slot: dict[int, list[Sequence[Any]]] = {}
        for command in lazy:
            by_slot.setdefault(slot_of(command), []).append(command)
        loop = asyncio.get_running_loop()
        for slot, commands in by_slot.items():
            task = loop.create_task(self._lazy(commands))
            self._lazy_slots.setdefault(slot, set()).add(task)
            task.add_done_callback(functools.partial(self._lazy_done, slot))

    def _lazy_done(self, slot: int, task: asyncio.Task[None]) -> None:
        waiting = self._lazy_slots.get(slot)
        if waiting is not None:
            waiting.discard(task)
            if not waiting:
                del self._lazy_slots[slot]

    async def _behind_lazies(self, slot: int) -> None:
        """Once the slot's lazy writes gone the long way (it has some) are done, or `LAZY_WAIT_S`
        passed (a node down, say; a page drops what is gone, the next activity adds it back)."""
        await asyncio.wait(set(self._lazy_slots[slot]), timeout=LAZY_WAIT_S)

    async def _lazy(self, lazy: Sequence[Sequence[Any]]) -> None:
        try:
            raised(await self.call(lazy, ordered=False))  # (two lazy writes need no order: GT, the same expiry)
        except Exception as exc:  # (best effort: a page drops what is gone, the next activity adds it back)
            log.warning("a lazy write after a script failed: %s", exc)

    def _riders(self, slot: int, commands: Sequence[Sequence[Any]]) -> list[int]:
        """Which of `commands` live on the node that owns `slot` (by the slot map as it is)."""
        node = self._owner(slot).name
        return [n for n, c in enumerate(commands) if self._owner(slot_of(c)).name == node]

    async def settle(self, keys: Sequence[Any]) -> None:
        """As `Wire.settle`, on the session's node."""
        if self.replicas is not None:
            slot = slot_of(("EVAL", "", len(keys), *keys))
            await self._mark(slot, self.replicas, keys, await self._on_slot(slot, self.replicas.sync(keys), unit=True))

    async def _mark(self, slot: int, replicas: Replicas, keys: Sequence[Any], synced: Sequence[Any]) -> None:
        mark = replicas.marking(keys, synced)
        if mark is not None:
            raised(await self._on_slot(slot, [mark]))

    async def _load(self, slot: int, source: str) -> None:
        (reply,) = await self._on_slot(slot, [("SCRIPT", "LOAD", source)], routed=False)
        if isinstance(reply, Exception):
            raise reply

    # ---- one slot ------------------------------------------------------------------------

    async def _on_slot(
        self,
        slot: int,
        commands: list[Sequence[Any]],
        *,
        routed: bool = True,
        unit: bool = False,
        riders: int = 0,
        ordered: bool = False,
    ) -> list[Any]:
        """`commands` (all in `slot`) on the slot's owner, redirections followed: a command
        refused with MOVED, ASK, TRYAGAIN or CLUSTERDOWN is sent again (with the others refused;
        with `unit`, with all of them: a script and the WAIT after it), until `REDIRECT_S`.
        The last `riders` commands are of other slots of the same node: sent with the first
        write only, their replies (refusals too) as they came; if a command of `slot` was
        refused in that write, theirs are BEFORE_SCRIPT (they ran before it: the caller sends
        them again). `ordered`: they go, and refused go again, only after the slot's lazy writes
        on their way the long way (a posted one refused just before them, on the same link, goes
        that way meanwhile)."""
        if not self._ready:
            await self.cluster.initialize()
            self._ready = True
        if ordered and slot in self._lazy_slots:
            await self._behind_lazies(slot)
        deadline = asyncio.get_running_loop().time() + REDIRECT_S
        first: list[Any] | NotSent
        try:  # (as nearly always: the slot's owner takes every command, and that is all)
            first = await self._pool(self._owner(slot)).call(commands)
        except NotSent as exc:
            first = exc
        else:
            for reply in first:
                if isinstance(reply, Exception):
                    break
            else:
                return first
        if ordered and slot in self._lazy_slots:
            await self._behind_lazies(slot)
        return await self._redirected(slot, commands, first, deadline, routed=routed, unit=unit, riders=riders)

    async def _redirected(
        self,
        slot: int,
        commands: list[Sequence[Any]],
        first: list[Any] | NotSent | None,
        deadline: float,
        *,
        routed: bool,
        unit: bool,
        riders: int,
    ) -> list[Any]:
        """`_on_slot` from its first write's outcome (`first`: replies with an error among them,
        or NotSent) on, until `deadline` (loop time)."""
        loop = asyncio.get_running_loop()
        replies: list[Any] = [None] * len(commands)
        everything = range(len(commands))
        todo: Sequence[int] = everything
        own = len(commands) - riders  # (the commands of `slot`; riders after them)
        ask: AskError | None = None
        tries = 0
        while True:
            batch = commands if todo is everything else [commands[n] for n in todo]
            try:
                got = await self._round(slot, batch, ask, first)
            except NotSent:
                if loop.time() >= deadline:
                    raise
                await self._wait(tries)
                tries += 1
                await self._refresh()
                ask = None
                continue
            finally:
                first = None
            if ask is not None:
                got = got[1::2]
            elif todo is everything and not any(isinstance(r, REFUSALS) for r in got):
                return got  # (as nearly always: each reply as it came)
            ask = None
            again: list[int] = []
            wait = refresh = False
            for n, reply in zip(todo, got, strict=True):
                replies[n] = reply
                # (a rider's refusal is its caller's to send again)
                how = await self._refused(reply) if routed and n < own and isinstance(reply, Exception) else None
                if how is None:
                    continue
                if isinstance(reply, AskError):
                    ask = reply  # (the commands of one slot are asked on together)
                wait, refresh = wait or how[0], refresh or how[1]
                again.append(n)
            if again and todo[-1] >= own:  # (the riders ran before their script: not after it)
                replies[own:] = [BEFORE_SCRIPT] * riders
            if not again or loop.time() >= deadline:
                return replies
            todo = everything if unit else again
            if wait:
                await self._wait(tries)
                tries += 1
            if refresh:
                await self._refresh()

    async def _round(
        self, slot: int, batch: list[Sequence[Any]], ask: AskError | None, first: list[Any] | NotSent | None
    ) -> list[Any]:
        """A round's replies: the first write's outcome, if given (NotSent raised again), else
        those of `batch` written to the slot's owner, or to the node that asked for it (with
        ASKING before each command, which it holds for the one command after it)."""
        if isinstance(first, NotSent):
            raise first
        if first is not None:
            return first
        if ask is None:
            return await self._pool(self._owner(slot)).call(batch)
        return await self._pool(self._asked(ask)).call([x for c in batch for x in (("ASKING",), c)])

    async def _refused(self, reply: Any) -> tuple[bool, bool] | None:
        """Whether a reply is a refusal to follow, and how: (wait first, read the map again)."""
        if isinstance(reply, MovedError):
            await self.cluster.nodes_manager.move_slot(reply)
            return False, False
        if isinstance(reply, AskError):
            return False, False
        if isinstance(reply, TryAgainError):  # (a multi-key command while its keys move: soon, all on one side)
            return True, False
        if isinstance(reply, ClusterDownError):
            return True, True
        return None

    def _owner(self, slot: int) -> ClusterNode:
        """The slot's primary, as the slot map has it (as `get_node_from_slot` reads it, without
        its replica choice: keel reads from primaries)."""
        try:
            node: ClusterNode = self.cluster.nodes_manager.slots_cache[slot][0]
        except (KeyError, IndexError):  # (a slot no node owns just now: SlotNotCoveredError)
            return self.cluster.nodes_manager.get_node_from_slot(slot)
        return node

    def _asked(self, ask: AskError) -> ClusterNode:
        node = self.cluster.get_node(host=ask.host, port=ask.port)
        if node is None:  # (a node the map does not have yet)
            node = ClusterNode(ask.host, ask.port, **self.cluster.nodes_manager.connection_kwargs)
        return node

    def _pool(self, node: ClusterNode) -> Pool:
        pool = self._pools.get(node.name)
        if pool is None:
            kwargs = {**node.connection_kwargs, "host": node.host, "port": node.port}
            pool = self._pools[node.name] = Pool(node.connection_class, kwargs, node.max_connections, self.timeout)
        return pool

    async def _refresh(self) -> None:
        """Read the slot map again (calls that meet a failover together read it once)."""
        with contextlib.suppress(Exception):  # (no node answers yet: the next try reads it again)
            await self.cluster.nodes_manager.initialize()

    @staticmethod
    async def _wait(tries: int) -> None:
        await asyncio.sleep(BACKOFF_S[min(tries, len(BACKOFF_S) - 1)])


_MERGED_FLAGS = frozenset({"GT", "LT", "NX", "XX"})  # (a ZADD of one pair and one of these: merged)


def together(commands: Sequence[Sequence[Any]]) -> list[Sequence[Any]]:
    """Lazy writes as fewer commands, to the same effect: the `ZADD key <flag> score member`s of
    a key as one ZADD of every pair, in their order (a member given twice is added twice, as it
    was), then the key's last PEXPIRE (after the adds: on a key they made, too). Anything else,
    or a key added to with two flags: as they are."""
    added: dict[Any, tuple[Any, list[Any]]] = {}
    expiries: dict[Any, Sequence[Any]] = {}
    for command in commands:
        if command[0] == "ZADD" and len(command) == 5 and command[2] in _MERGED_FLAGS:
            flag, pairs = added.setdefault(command[1], (command[2], []))
            if flag != command[2]:
                return list(commands)
            pairs.extend(command[3:])
        elif command[0] == "PEXPIRE" and len(command) == 3:
            expiries[command[1]] = command
        else:
            return list(commands)
    merged: list[Sequence[Any]] = [("ZADD", key, flag, *pairs) for key, (flag, pairs) in added.items()]
    return [*merged, *expiries.values()]


AnyWire = Wire | ClusterWire  # the store's hot path: `wire_for` picks one
