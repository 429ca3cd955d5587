"""Webhook channels (Slack; Linear and outbound event webhooks build on the same seam):
inbound requests verified and turned into keel calls, committed events delivered by the
delivery relay. `base` is the seam, `slack` and `slack_out` its first channel."""
