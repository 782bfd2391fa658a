"""Phrase pools of the lint corpus, by class, in two disjoint phrasings.

`train` is what the project's corpus uses; `holdout` words every class
differently (other labels, other formats, other look-alikes) and is only
used to check that the rules follow classes, not one generator's strings.

Classes:
- killers: dynamic values injected into a system prompt (per request, per
  session, or rotating free text); `KILLER_KIND` is the generator's kind,
  which the corpus relabels by behaviour (a value constant inside each
  session but different across sessions becomes `session`);
- look-alikes: values that look dynamic (office hours, policy and founding
  dates, versions, a support address, a pinned build hash, a workspace id)
  but are the same in every request of a family.
"""

from __future__ import annotations

import random
import string
import uuid
from datetime import date, timedelta

#: killer -> (prefix, suffix) per phrasing.
KILLER_PHRASES: dict[str, dict[str, list[tuple[str, str]]]] = {
    "train": {
        "time": [("Current time: ", ""), ("It is now ", " for this conversation.")],
        "user": [("user_id: ", ""), ("Customer ID: ", "")],
        "session": [("Session ", " is active."), ("session_id=", "")],
        "email": [("Signed-in user email: ", ""), ("Reply-to address: ", "")],
        "jwt": [("Authorization context: Bearer ", "")],
        "apikey": [("Tool gateway key: ", "")],
        "digest": [("Config digest ", " loaded."), ("State hash: ", "")],
        "nonce": [("nonce=", ""), ("cache_buster: ", "")],
        "counter": [("This is request #", " of the session."), ("turn_number: ", "")],
        "handle": [("Signed in as ", "."), ("Operator handle: ", "")],
        "org": [("Workspace: ", "."), ("Helping the team at ", " today.")],
        "plan": [("Subscription plan: ", "."), ("Account tier: ", "")],
        "weather": [("Weather at the office right now: ", ".")],
        "tip": [("Tip of the day: ", "")],
        "headline": [("Top story this hour: ", "")],
        "incidents": [("Open incidents: ", "")],
    },
    "holdout": {
        "time": [("Request received at ", "."), ("Local time for the user is ", "")],
        "user": [("Acting for account_no ", ""), ("member_number: ", "")],
        "session": [("conversation_id: ", ""), ("Thread key = ", "")],
        "email": [("Notify ", " when done."), ("Primary contact: ", "")],
        "jwt": [("Forwarded token ", "")],
        "apikey": [("Use credential ", " for the search tool.")],
        "digest": [("Snapshot ", " is current."), ("etag: ", "")],
        "nonce": [("salt: ", ""), ("retry_count=", "")],
        "counter": [("Turn #", " so far."), ("attempt_number: ", "")],
        "handle": [("The user goes by ", " in chat."), ("Login: ", "")],
        "org": [("Company on file: ", ""), ("Tenant name: ", ".")],
        "plan": [("Billing level: ", ""), ("Support contract: ", " tier.")],
        "weather": [("Outside it is ", " at the moment.")],
        "tip": [("Remember: ", "")],
        "headline": [("Latest company news: ", "")],
        "incidents": [("Pager status: ", "")],
    },
}
KILLER_KIND = {"time": "timestamp", "user": "identifier", "session": "identifier",
               "email": "identifier", "jwt": "identifier", "apikey": "identifier",
               "digest": "identifier", "nonce": "nonce", "counter": "nonce",
               "handle": "learned", "org": "learned", "plan": "learned",
               "weather": "learned", "tip": "learned", "headline": "learned",
               "incidents": "learned"}
KILLERS = tuple(KILLER_KIND)

WEATHER = ["sunny", "light rain", "overcast", "snow showers", "thunderstorms", "fog",
           "clear skies with a cold wind"]
TIPS = ["Small commits are easier to review.", "Write the test before the fix.",
        "Name things after what they hold.", "Measure before optimising.",
        "Delete dead code early.", "Read the error message twice."]
HEADLINES = ["Quarterly planning starts Monday", "New VPN client rolled out",
             "Cafeteria closed for renovation", "Hackathon winners announced",
             "Office move postponed", "Security training due this week"]
INCIDENTS = ["none", "1 (search latency)", "2 (billing export, login errors)",
             "3 (db failover, queue backlog, DNS)"]
ORGS = ["Acme Robotics", "Blue Finch Labs", "Northwind Traders", "Orbital Bakery",
        "Quartz & Vine", "Tidewater Health"]
PLANS = ["free", "team", "business", "enterprise"]

#: Look-alike line templates per phrasing; {placeholders} get per-family values.
LOOKALIKES: dict[str, list[str]] = {
    "train": [
        "Office hours: {clock_a}-{clock_b} UTC, Monday to Friday.",
        "This policy took effect on {iso_date}.",
        "The company was founded on {written_date}.",
        "API version {iso_date_2} is the only one you may call.",
        "Escalations go to {email}.",
        "Pinned build {hex}; never suggest other builds.",
        "Workspace id {uuid} (shared by every user of this deployment).",
        "Data before {epoch} has been archived.",
    ],
    "holdout": [
        "Support desk staffed {clock_a} to {clock_b} CET on weekdays.",
        "Terms last revised {dmy_date}.",
        "Our first store opened {written_date_2}.",
        "Model snapshot {iso_date_2} serves every answer.",
        "Abuse reports: {email}.",
        "Release checksum {hex} must match before deploys.",
        "Deployment {uuid} hosts this assistant.",
        "Retention cutoff (epoch seconds): {epoch}.",
    ],
}


def random_token(rng: random.Random, n: int,
                 alphabet: str = string.ascii_letters + string.digits) -> str:
    """A random mixed-case token with at least three digits."""
    while True:
        s = "".join(rng.choice(alphabet) for _ in range(n))
        if sum(c.isdigit() for c in s) >= 3 and any(c.isupper() for c in s) and \
                any(c.islower() for c in s):
            return s


def lookalike_values(rng: random.Random) -> dict[str, str]:
    """Per-family values for the look-alike placeholders."""
    d = date(2015, 1, 1) + timedelta(days=rng.randint(0, 3000))
    d2 = date(2023, 1, 1) + timedelta(days=rng.randint(0, 700))
    start = rng.choice([7, 8, 9])
    return {"clock_a": f"{start:02d}:00", "clock_b": f"{start + 8 + rng.randint(0, 2)}:30",
            "iso_date": d.isoformat(), "iso_date_2": d2.isoformat(),
            "written_date": d.strftime("%B ") + str(d.day) + d.strftime(", %Y"),
            "written_date_2": str(d2.day) + d2.strftime(" %B %Y"),
            "dmy_date": d2.strftime("%d/%m/%Y"),
            "email": rng.choice(["support", "help", "oncall"]) + "@" +
            rng.choice(["acme", "initech", "globex"]) + ".example",
            "hex": "".join(rng.choice("0123456789abcdef") for _ in range(16)) + "a1",
            "uuid": str(uuid.UUID(int=rng.getrandbits(128))),
            "epoch": str(rng.randint(1_600_000_000, 1_700_000_000))}


def handle(rng: random.Random) -> str:
    """A user handle such as user_k3j9x2 (no pattern names it)."""
    tail = "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(6))
    return rng.choice(["user_", "u-", "@"]) + tail
