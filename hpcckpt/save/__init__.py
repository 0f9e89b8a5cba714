"""The save behind the step: a snapshot's way into the levels (plan, node-local and global
stages, L4 at its own pace, the end-of-run drain), its commit records, retention and room."""
