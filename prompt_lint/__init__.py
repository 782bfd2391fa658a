"""prompt_lint package."""
