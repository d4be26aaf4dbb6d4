"""Byte units. Memory figures in papers are decimal (the ZeRO paper's 120 GB for 7.5B
parameters is 16 x 7.5e9 bytes); GPU capacities are binary (an "80 GB" card shows 81920 MiB)."""

KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12
KiB, MiB, GiB = 2.0**10, 2.0**20, 2.0**30
