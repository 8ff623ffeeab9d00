/* Writes the snapshot c_examples/engine_snapshot.c loads: version 1 in DIR
 * and version 2 in DIR/next; and the tensor-parallel model
 * c_examples/engine_tp.c loads, step 3, in DIR/tp. */
#include <stdio.h>
#include "fixture.h"

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  char next[1024], tp[1024];
  if (snprintf(next, sizeof next, "%s/next", argv[1]) >= (int)sizeof next ||
      snprintf(tp, sizeof tp, "%s/tp", argv[1]) >= (int)sizeof tp) {
    fprintf(stderr, "make_example_snapshot: %s: too long a path\n", argv[1]);
    return 2;
  }
  if (fixture_example_model(argv[1], 1.0f, "1") != 0 || fixture_example_model(next, 2.0f, "2") != 0 ||
      fixture_tp_model(tp, 3) != 0) {
    perror("writing example snapshot");
    return 1;
  }
  return 0;
}
