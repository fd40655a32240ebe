// The wire contract's vocabulary, generated from wsinfer/contract.py by
// `python -m wsinfer.clients.gen_contract`: do not edit by hand.

export type ClientMessageTypeName = "generate" | "stop" | "pause" | "resume" | "continue" | "close";

// The controls of a turn: `turn.control(type)`.
export type ControlType = "stop" | "pause" | "resume" | "continue";
