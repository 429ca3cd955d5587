"""An owner's list of sessions (harness/store/catalog.py) at the store: pages cut by cursor where
many sessions share one millisecond of activity (each given once, in Redis's order), entries
whose session is gone dropped from the page and from the list, and another owner's sessions never
on it."""

from __future__ import annotations

import time
from collections.abc import Callable

from redis.asyncio import Redis

from harness.ids import new_id
from harness.store import Store, cursor_of
from harness.store.keys import OwnerKeys, SessionKeys


async def walk(store: Store, owner: str, limit: int) -> list[str]:
    seen: list[str] = []
    cursor = None
    while True:
        page = await store.catalog.page(owner, limit=limit, cursor=cursor, now=time.time())
        seen += [i.session_id for i in page.items]
        if page.next_cursor is None:
            return seen
        cursor = cursor_of(page.next_cursor)


async def test_sessions_of_one_millisecond_are_each_given_once(stores: Callable[[], Store], redis: Redis) -> None:
    store = stores()
    await store.start()
    sids = [new_id("ses") for _ in range(25)]
    for sid in sids:
        await store.create(sid, "o", {})
    key = OwnerKeys("o").sessions
    await redis.zadd(key, {sid: 1_700_000_000_000 for sid in sids[:20]}, xx=True)  # one ms for 20 of them
    order = [m.decode() for m in await redis.zrange(key, 0, -1, desc=True)]  # Redis's: (ms, id), highest first
    assert order[5:] == sorted(sids[:20], reverse=True)
    expected = order
    for limit in (1, 2, 3, 7, 20, 100):
        assert await walk(store, "o", limit) == expected, limit


async def test_a_session_gone_leaves_the_page_and_the_list(stores: Callable[[], Store], redis: Redis) -> None:
    store = stores()
    await store.start()
    kept, gone = new_id("ses"), new_id("ses")
    await store.create(kept, "o", {})
    await store.create(gone, "o", {})
    await store.create(new_id("ses"), "someone else", {})
    await redis.delete(SessionKeys(gone).meta)  # (as its expiry would: the list not told)
    page = await store.catalog.page("o", limit=10, now=time.time())
    assert [i.session_id for i in page.items] == [kept] and page.next_cursor is None
    assert await redis.zrange(OwnerKeys("o").sessions, 0, -1) == [kept.encode()]
