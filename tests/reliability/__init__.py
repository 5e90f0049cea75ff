"""Fault-injection tests (issue 24): each injects one fault and checks the error and that nothing is lost."""
