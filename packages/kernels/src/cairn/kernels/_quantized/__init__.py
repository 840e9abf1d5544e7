"""quantized: api (the public function and its registration), xla, and the Pallas implementations."""
