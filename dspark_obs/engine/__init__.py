"""Embedded DSpark runtime: target, drafter, acceptance, scheduler + cost tables, decode loop."""
