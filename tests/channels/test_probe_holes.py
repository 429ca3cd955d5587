"""What a hostile probe found (issue 29), each pinned: IPv6 forms that embed an inside IPv4
address, browser tokens re-encoded to dodge the per-token socket limit, non-ASCII numbers in
`?timeout=`, a trailing slash redirected to the request's Host, short secrets in logs."""

from __future__ import annotations

import ipaddress
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from app.logs import REDACTED, Redactor, secrets_of
from app.settings import Settings
from channels.tokens import TokenSigner, _b64, _unb64
from channels.webhooks.addresses import public
from tests.channels.slack_support import echo_agent

INSIDE_V4 = [
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "0.0.0.0/8",
        "100.64.0.0/10",
    )
]


@st.composite
def inside_v4(draw: st.DrawFn) -> ipaddress.IPv4Address:
    net = draw(st.sampled_from(INSIDE_V4))
    return net[draw(st.integers(0, net.num_addresses - 1))]


def embeddings(v4: ipaddress.IPv4Address, salt: int) -> list[str]:
    """Every IPv6 form that carries `v4`: mapped, translated, compatible, NAT64 (well-known and
    local-use prefixes), 6to4, Teredo (client, obfuscated; and server)."""
    n = int(v4)
    hi, lo = n >> 16, n & 0xFFFF
    ob_hi, ob_lo = (n ^ 0xFFFFFFFF) >> 16, (n ^ 0xFFFFFFFF) & 0xFFFF
    return [
        f"::ffff:{v4}",
        f"::ffff:0:{hi:x}:{lo:x}",
        f"::{v4}",
        f"64:ff9b::{v4}",
        f"64:ff9b:1:{salt & 0xFFFF:x}::{hi:x}:{lo:x}",
        f"2002:{hi:x}:{lo:x}:{salt & 0xFFFF:x}::1",
        f"2001:0:{hi:x}:{lo:x}:0:{salt & 0xFFFF:x}:{ob_hi:x}:{ob_lo:x}",  # server v4, client obfuscated
        f"2001:0:808:808:0:{salt & 0xFFFF:x}:{ob_hi:x}:{ob_lo:x}",  # a public server, the client inside
    ]


@settings(max_examples=300, deadline=None)
@given(inside_v4(), st.integers(0, 2**16 - 1))
def test_every_ipv6_form_that_embeds_an_inside_ipv4_address_is_refused(v4: ipaddress.IPv4Address, salt: int) -> None:
    for form in embeddings(v4, salt):
        assert not public(form), form


def test_public_addresses_stay_public() -> None:
    assert public("93.184.216.34") and public("2606:2800:220:1:248:1893:25c8:1946")
    assert public("::ffff:93.184.216.34")  # (mapped: judged by the IPv4 address it carries)


def test_a_browser_token_is_accepted_in_its_one_encoding_only() -> None:
    signer = TokenSigner(b"s" * 32, 60)
    token, _ = signer.mint("ses_1", "owner-1")
    assert signer.verify(token, "ses_1") == "owner-1"
    body, mac = token.split(".")
    raw = _unb64(body)
    for other in (f"{body}=.{mac}", f"{body}.{mac}==", f"{body}!!.{mac}", f"{body[:4]}!!{body[4:]}.{mac}"):
        assert signer.verify(other, "ses_1") is None, other
    assert _b64(raw) == body


async def test_a_timeout_takes_ascii_digits_only(serve: Any) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        for raw in ("%D9%A1", "%EF%BC%91", "1_0", "%201", "inf", "nan", "1e3", "-1", "0"):
            r = await c.post(f"/v1/sessions/{sid}/messages?wait=true&timeout={raw}", json={"text": "hi"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_query", (raw, r.text)
        assert (await c.get(f"/v1/sessions/{sid}/history")).json()["items"] == []
        ok = await c.post(f"/v1/sessions/{sid}/messages?wait=true&timeout=2.5", json={"text": "hi"})
        assert ok.status_code == 200


async def test_a_trailing_slash_is_a_404_not_a_redirect_to_the_hosts_name(serve: Any) -> None:
    live = await serve(echo_agent(), api_keys=("the-key",))
    async with live.client() as c:
        for path in ("/metrics/", "/v1/sessions/", "/healthz/"):
            r = await c.get(path, headers={"Host": "evil.example"}, follow_redirects=False)
            assert r.status_code in (401, 404) and "location" not in r.headers, (path, r.status_code, r.headers)


def test_every_configured_secret_is_redacted_whatever_its_length() -> None:
    settings_ = Settings(api_keys=("keyA", "k2"))
    redact = Redactor(secrets_of(settings_, {}))
    line = "GET /v1/x?api_key=keyA&b=1 auth keyA k2 ?secret=zzz&key=q1&token=t"
    out = redact(line)
    for secret in ("keyA", "k2", "zzz", "q1"):
        assert secret not in out.replace(REDACTED, ""), out
    assert out.count(REDACTED) >= 6
