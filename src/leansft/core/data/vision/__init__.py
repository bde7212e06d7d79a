"""Vision-language SFT: images in conversations, their tokens, the vision tower's inputs, packed forwards."""
