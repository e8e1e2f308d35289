"""A `verifiers` environment written as a hub package would be (`taskset.id: vf-products`):
products of two numbers, answered as the last number of the reply, with or without its
`multiply` tool (an MCP server verifiers starts as `python -m vf_products`)."""

import re

import verifiers.v1 as vf

PROBLEMS = {"train": [(6, 7), (3, 5), (4, 4)], "test": [(9, 9)]}


class ProductData(vf.TaskData):
    answer: int


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b


class ProductTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()
    with_tool: bool = False


class ProductTask(vf.Task[ProductData, vf.State, ProductTaskConfig]):
    @classmethod
    def toolsets(cls, config: ProductTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)] if config.with_tool else []

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)


class ProductsConfig(vf.TasksetConfig):
    split: str = "train"
    task: ProductTaskConfig = ProductTaskConfig()


class ProductsTaskset(vf.Taskset[ProductTask, ProductsConfig]):
    def load(self):
        for i, (a, b) in enumerate(PROBLEMS[self.config.split]):
            data = ProductData(
                id=f"{self.config.split}-{i}",
                prompt=f"What is {a} times {b}?",
                system_prompt="Answer with a number.",
                answer=a * b,
            )
            yield ProductTask(data, self.config.task)


__all__ = ["ProductsTaskset"]

if __name__ == "__main__":
    CalcToolset.run()
