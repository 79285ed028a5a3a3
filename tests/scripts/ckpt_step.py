"""The step counter the kill -9 scripts register for checkpointing (weights are set to it on save)."""


class Step:
    def __init__(self) -> None:
        self.value = -1

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]
