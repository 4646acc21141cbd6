// Builds against gwt the way a user would and takes a few optimizer steps.
#include <gwt/gwt.h>

#include <iostream>

int main() {
  at::Tensor w = at::randn({16, 64}).requires_grad_(true);
  gwt::WaveletAdam opt({w}, gwt::WaveletAdamOptions(1e-2).level(2));
  for (int t = 0; t < 3; ++t) {
    opt.zero_grad();
    w.pow(2).sum().backward();
    opt.step();
  }
  const int64_t expected = 2 * 16 * 16 * 4 + 4;  // quarter-size moments + limiter norm
  std::cout << "gwt " << gwt::version << " consumer: state_bytes " << opt.state_bytes() << "\n";
  return opt.state_bytes() == expected ? 0 : 1;
}
